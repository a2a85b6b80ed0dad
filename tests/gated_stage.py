"""`python tests/gated_stage.py GATE stage ARGS...`: `ditkv stage ARGS...` whose AR writes wait until the
file GATE exists (`GATE.waiting` appears once one waits): `ARStageServer` with the `ServerGate`
hook of rank_hooks.py."""

import sys

from rank_hooks import ServerGate

from ditkv.entrypoints.cli import main
from ditkv.stages import ar_server


class _GatedServer(ar_server.ARStageServer):
    def __init__(self, graph, bind, model_bundle=None):
        super().__init__(graph, bind, model_bundle, hooks=ServerGate(GATE))


if __name__ == "__main__":
    GATE = sys.argv[1]
    ar_server.ARStageServer = _GatedServer  # what `ditkv stage` builds
    sys.exit(main(sys.argv[2:]))
