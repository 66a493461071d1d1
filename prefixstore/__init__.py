"""prefixstore: a transactional host-tier storage engine for LLM prefix caches."""

from prefixstore.base.destination import Pieces
from prefixstore.base.errors import PrefixStoreError
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec

__all__ = ["Layout", "Pieces", "Prefix", "PrefixStoreError", "TensorSpec"]
__version__ = "0.1.0"
