"""Coverage-guided fuzzing of kvx's data-plane framing and handshake.

``targets.py`` holds the targets (plain functions of one ``bytes`` input that
raise ``Finding`` or let an unexpected exception out when kvx misbehaves);
``runner.py`` drives one of them with atheris (libFuzzer) and
``test_fuzz_targets.py`` runs each for a short, seeded budget in CI
(``KVX_FUZZ_RUNS`` raises it). ``benchmarks/fuzz.py`` runs them long.
``test_metadata_service.py`` is a hypothesis property test of the metadata
gRPC service. docs/contributing.md says how to run them.
"""
