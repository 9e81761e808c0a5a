from flashrun.cli import main

main()
