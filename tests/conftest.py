import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_SILENT", "true")
