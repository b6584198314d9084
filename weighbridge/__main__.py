from weighbridge.cli import main

main()
