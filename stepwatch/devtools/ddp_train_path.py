"""Where the real DDP training script lives (``ddp_train.py`` beside this module), without importing it
(it imports torch and trains when run)."""
from pathlib import Path

ddp_train_file = str(Path(__file__).with_name("ddp_train.py"))
