"""What tests share: tiny models and fixtures' helpers (`helpers`), a real MLflow server on 127.0.0.1
(`mlflow_server`), a torch stand-in for FlashInfer's CUDA kernels (`torch_flashinfer`)."""
