from kitcli.cli import main

main()
