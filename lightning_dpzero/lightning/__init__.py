"""The Trainer face: ``DPDeepSpeedStrategy`` (``strategy.py``) and ``PrivacyAccountantCallback``
(``callback.py``), where Lightning's loops meet the DP step (``loop.py``, ``manual_loop.py``), the settings both
strategies share (``settings.py``), the checks before launch and the refusals, the strategy names and their
registration with the Trainer and Fabric, and the one way the command builds ``LightningCLI``
(docs/design.md, *Layout*). Imports nothing: ``import lightning_dpzero`` reaches ``registration.py`` alone."""
