"""`python -m kitcli.tiny build [DIR]`, the tiny model's builder under its public name (code: kitcli/models/tiny.py)."""

if __name__ == "__main__":
    from kitcli.models.tiny import main

    main()
