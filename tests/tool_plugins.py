"""Tools and environments, good and bad, that tests/test_tools.py names as plugins (copied as my_tools.py)."""


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: The key.
    """
    return key.upper()


def calculator(expression: str) -> str:
    """A second calculator.

    Args:
        expression: What to compute.
    """
    return expression


not_a_function = 3


def untyped(key):
    """No type hint.

    Args:
        key: The key.
    """


def undocumented(key: str) -> str:
    return key


def args_not_described(key: str) -> str:
    """Has a docstring but no Args section."""
    return key


class Counter:
    """Counts."""

    def reset(self, **kwargs) -> None:
        self.total = 0

    def add(self, n: int) -> str:
        """Add to the total.

        Args:
            n: How much to add.
        """
        self.total += n
        return str(self.total)


class ResetFails(Counter):
    """Counts, once its reset works."""

    def reset(self, **kwargs) -> None:
        raise ValueError(f"no level {kwargs.get('level')!r}")


class NoReset:
    add = Counter.add


def f(x: str) -> str:
    """F.

    Args:
        x: X.
    """
    return x + "7"
