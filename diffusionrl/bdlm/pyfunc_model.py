"""The pyfunc entry point MLflow executes when it loads a registered BDLM ("models from code":
no pickled Python object in the model; the decoder class comes from the installed package)."""

import mlflow.models

from diffusionrl.bdlm.serving import BDLMDecoder

mlflow.models.set_model(BDLMDecoder())
