"""draftheads: train and evaluate speculative-decoding draft heads for a frozen target LLM.

The jobs live in the top-level folders users expect (``data_prep/``, ``train/``, ``eval/``, ``scripts/``);
this package holds what sits above them: the ``draftheads`` command.
"""

__version__ = "0.1.0"
