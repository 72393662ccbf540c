"""train.loggers name -> the class that writes that logger, as "module:Class": the one line a
new logger adds (its file goes in titanax/train/loggers/, or in any importable module). Plain
data, so the config checks names against it without importing jax or a logger library;
train/loggers/ imports a class only when a run names it (W&B and MLflow load only for the runs
that use them)."""

LOGGERS: dict[str, str] = {
    "jsonl": "titanax.train.loggers.jsonl:JsonlLogger",
    "tensorboard": "titanax.train.loggers.tensorboard:TensorBoardLogger",
    "wandb": "titanax.train.loggers.wandb:WandbLogger",
    "mlflow": "titanax.train.loggers.mlflow:MlflowLogger",
}

# Every run writes it: loss plots, the rows a resume trims and the tests read metrics.jsonl.
REQUIRED_LOGGER = "jsonl"
DEFAULT_LOGGERS = "jsonl,tensorboard"
