"""Checking a config someone already has: ``lint`` runs the rules (``rules_keys`` for keys and
values, ``rules_memory`` for memory and layout) and reports ``findings``; ``wrap_probe`` checks the
wrap classes against the model itself."""
