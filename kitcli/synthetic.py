"""`python -m kitcli.synthetic [DIR]`: the kit's dataset writer under its public name (kitcli/data/synthetic.py)."""

if __name__ == "__main__":
    from kitcli.data.synthetic import main

    main()
