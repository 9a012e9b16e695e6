from kitcli.commands.cli import main

main()
