"""What decodes: a converted folder loaded with its MTP head, draft/verify with rollback, batched streams."""
