"""prefixstore: a transactional host-tier storage engine for LLM prefix caches."""

from prefixstore.engine.errors import PrefixStoreError
from prefixstore.engine.keys import Prefix
from prefixstore.engine.layout import Layout, TensorSpec

__all__ = ["Layout", "Prefix", "PrefixStoreError", "TensorSpec"]
__version__ = "0.1.0"
