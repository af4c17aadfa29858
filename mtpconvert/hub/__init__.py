"""The Hugging Face Hub: pull what a conversion needs (whole, streamed or sparse), the model card, upload."""
