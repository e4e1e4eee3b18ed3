from rollstream.cli import main

main()
