"""Tensors that hold KV: the device pool (L1) and the req_to_token table."""
from kvstrata.kv.device_pool import MHATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable

__all__ = ["MHATokenToKVPool", "ReqToTokenTable"]
