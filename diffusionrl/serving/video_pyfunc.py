"""The pyfunc entry point MLflow executes when it loads a registered video LoRA ("models from code":
no pickled Python object in the model; the class comes from the installed package)."""

import mlflow.models

from diffusionrl.serving.video_model import VideoLoraModel

mlflow.models.set_model(VideoLoraModel())
