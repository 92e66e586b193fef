"""The training loop in one call, ``partita.fit``, and what it is made of: data sources and their
re-batching into global batches (``data_source``, ``batch_layout``), LR schedules by name
(``lr_schedule``), metrics (``metrics``) and the run's records (``run_log``).

The layer above the runtime: it drives a ``partita.Trainer``; the command line (``partita train``)
calls ``fit.run_loop`` as Python users call ``partita.fit``.
"""
