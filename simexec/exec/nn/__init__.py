"""The torch side: the GPT model, optimizer, clipping, loss scaling, data."""
