"""Runnable examples: `calculator` is a multi-turn generate function with a calculator tool."""
