"""The names of everything a DP checkpoint holds: one definition of each file name and key.

A checkpoint written by :class:`~lightning_dpzero.DPDeepSpeedStrategy` is DeepSpeed's directory
(``latest``, the tag folder with the ZeRO shards) plus, beside the shards, the ledger as JSON and the commit
marker written last (docs/design.md, *Checkpoints*).
"""

LEDGER_FILE = "privacy_ledger.json"  #: the ledger beside the ZeRO shards, in an export, in a logger's log_dir
LEDGER_KEY = "privacy_ledger"  #: the ledger's key in the DeepSpeed client state and in an exported file
CALLBACK_STATE_KEY = "PrivacyAccountantCallback"  #: the accountant callback's ``state_key`` (its state holds the ledger too)
COMMIT_FILE = "privacy_commit.json"  #: written last by rank 0: the checkpoint is complete
INCOMPLETE_FILE = ".privacy_checkpoint_incomplete"  #: written first, removed after the commit
COMMIT_FORMAT = "lightning_dpzero.privacy_commit"
COMMIT_FORMAT_VERSION = 1
DEFAULT_TAG = "checkpoint"  #: the tag folder Lightning's DeepSpeedStrategy saves under
#: rank 0's DeepSpeed model-states file (holds the client state): ZeRO 0-2 name, ZeRO-3 name
MODEL_STATES_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
NOISE_STATE_FILE = "privacy_noise_rank{rank}.pt"  # a rank's correlated-noise history (mechanism.correlated.CorrelatedNoise)
