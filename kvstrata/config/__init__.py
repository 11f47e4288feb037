"""Start-up configuration: ServerArgs (what the user asked for) and the resolution pipeline
(what platform and model turn it into, with a recorded reason for every change).

Pure Python: importing this package does not import torch.
"""
from kvstrata.config.resolve import (check_serve_platform, log_resolutions, refuse_unimplemented,
                                     resolve, unimplemented_flags)
from kvstrata.config.resolve_explain import (add_explain_args, explain, explain_data,
                                             explain_main, run_explain)
from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs
from kvstrata.config.server_args import ServerArgs, flag

__all__ = ["ServerArgs", "ResolvedArgs", "Resolution", "ModelInfo", "resolve", "explain",
           "explain_data", "explain_main", "add_explain_args", "run_explain", "unimplemented_flags", "refuse_unimplemented",
           "check_serve_platform", "log_resolutions", "flag"]
