from trainforge.model.config import FLAVORS, ModelConfig, model_config_from_section
from trainforge.model.llama import Transformer, build_model

__all__ = ["FLAVORS", "ModelConfig", "Transformer", "build_model", "model_config_from_section"]
