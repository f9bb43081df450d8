from codeplane.cli import main

main()
