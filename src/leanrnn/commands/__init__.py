"""CLI subcommands (see ``leanrnn.cli``); each module registers one or a few commands."""
