"""The `msrl` command-line entry point and its subcommands (thin: parse arguments, call the library)."""
