"""Privacy-preserving graph expansion: keyed item tokens, the third-party service, its client."""

from .client import NeighbourClient, NeighbourServiceError
from .service import NeighbourService, RequestError, serve
from .tokens import item_tokens, new_handle, new_run_key

__all__ = ["NeighbourClient", "NeighbourService", "NeighbourServiceError", "RequestError", "item_tokens",
           "new_handle", "new_run_key", "serve"]
