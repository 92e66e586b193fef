"""The ``partita`` command line (``main``) and the helpers only it uses: loading a MODEL argument
(``model_spec``) and the training loop of ``partita train`` (``train_loop``)."""

from partita.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
