from vime.cli import main

main()
