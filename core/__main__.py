from outrider.cli import main

main()
