"""The handlers of the `nmt` subcommands, one module per family; nmt.cli builds the parser and dispatches to them.
Each handler imports its heavy modules inside the function, so that `nmt --help` stays cheap."""
