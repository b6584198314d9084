from weighbridge.app.cli import main

main()
