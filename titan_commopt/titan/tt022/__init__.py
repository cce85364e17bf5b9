"""torchtitan 0.2.2: the run (``run_context.py``), our Trainer and ``main`` (``trainer.py``), the
TrainSpecs (``spec.py``) and what they build: the optimizer container (``build.py``), the parallelize
wrapper (``parallelize.py``), the metrics processor (``metrics.py``), the SentencePiece tokenizer
(``tokenizer.py``); and this line's checks of the model, tokenizer and data (``checks.py``)."""
