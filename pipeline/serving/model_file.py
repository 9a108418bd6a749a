"""The model file a registered drafter is logged with (MLflow "models from code"): the registry keeps this file, the
bundle and a JSON config, never a pickled object. MLflow runs it when it loads the model."""
from mlflow.models import set_model

from pipeline.serving.pyfunc import DraftsmithPyfunc

set_model(DraftsmithPyfunc())
