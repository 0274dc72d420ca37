from draftheads.heads import schema as _schema  # noqa: F401  registers the typed config schemas (heads/schema.py)
