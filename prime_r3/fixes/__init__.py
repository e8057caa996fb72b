"""One module per patch; each declares ``SPEC`` and is listed in ``prime_r3.patches``."""
