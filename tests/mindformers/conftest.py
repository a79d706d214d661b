"""tests/mindformers: mindformers 2.1.0's own FSDP training on gradpool (``make mindformers``;
``make test`` leaves this directory out: docs/mindformers.md)."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
# mindformers' logger writes ./output/log under the working directory unless told otherwise.
os.environ.setdefault("LOG_MF_PATH", os.path.join(tempfile.gettempdir(), "gradpool-mindformers-log"))
