"""The pyfunc entry point MLflow executes when it loads a registered full fine-tune ("models from code":
no pickled Python object in the model; the class comes from the installed package)."""

import mlflow.models

from diffusionrl.serving.full_model import FullModel

mlflow.models.set_model(FullModel())
