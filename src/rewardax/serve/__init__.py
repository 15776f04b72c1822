"""`rewardax serve` and its in-process form: a reward model answering RL loops.

`reward_function` needs only rewardax; the HTTP server (`rewardax.serve.app`, `.server`) needs the
`serve` extra (starlette, uvicorn), imported when a server is built.
"""

from rewardax.serve.model import ServingModel, reward_function

__all__ = ["ServingModel", "reward_function"]
