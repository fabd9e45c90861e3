"""Data-plane transports. Each is one small interface: see ``base.py``."""
