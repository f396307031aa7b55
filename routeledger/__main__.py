from routeledger.cli import main

main()
