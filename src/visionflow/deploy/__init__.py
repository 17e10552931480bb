"""After training: export with the parity gate, INT8 (quantize), predictions from exported files
(inference), the HTTP server (serve), the model card (report) and pictures (viz)."""
