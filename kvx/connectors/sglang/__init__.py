"""kvx in SGLang: ``--disaggregation-transfer-backend kvx`` (see ``plugin`` and ``conn``).

``kvx.connectors.sglang.engine`` (the address-based transfer engine) needs
only kvx; ``conn`` imports SGLang.
"""
