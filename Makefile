# make demo   sets everything up, then trains a small GPT on Shakespeare by weight streaming on two data-parallel
#             systems (--num_csx 2), samples from it, plots its loss, runs the cstorch-API example the same
#             way, and places Llama-3.1-70B on four WSE-3 wafers (projection + picture)
# make test   sets everything up, then runs the test suite
# make docs   builds the documentation site (docs/, the README its home page) into build/site
PYTHON ?= python3
WSC = $(PYTHON) -m waferscale
DEMO_DIR ?= runs/demo

.PHONY: setup demo test test-fast docs clean

setup:
	@PYTHON=$(PYTHON) bash scripts/setup.sh

demo: setup
	rm -rf $(DEMO_DIR)
	$(WSC) run --params configs/gpt2_tiny_shakespeare.yaml --mode train_and_eval --model_dir $(DEMO_DIR) \
		--execution streaming --num_csx 2
	@echo "--- a sample from the trained model ---"
	$(WSC) generate --checkpoint $(DEMO_DIR) --prompt "ROMEO:" --max_new_tokens 300 --temperature 0.8 --seed 0
	$(WSC) plot $(DEMO_DIR)
	@echo "--- the cstorch API: a user's own training loop, weight streaming on two systems ---"
	$(PYTHON) examples/cstorch_train.py --num_csx 2 --steps 40 --checkpoint_steps 20 --artifact_dir $(DEMO_DIR)/cstorch
	@echo "--- the wafer: Llama-3.1-70B inference placed on 4 x WSE-3 (a projection) ---"
	$(WSC) compile --model llama3.1-70b --target wse3 --systems 4 --out $(DEMO_DIR)/wafer

test: setup
	$(PYTHON) -m pytest -q

test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow and not assets"

docs: setup
	$(PYTHON) scripts/docs.py

clean:
	rm -rf runs .setup-stamp .pytest_cache
