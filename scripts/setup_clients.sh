#!/usr/bin/env bash
# The agent CLIs the client tests drive the server with (tests/test_clients.py): OpenAI's Codex CLI (the Responses
# API) and Claude Code (Anthropic's Messages API), each from npm into a folder of its own under .clients/ (git-ignored;
# each ~400 MB, ~10 s from the registry). Idempotent; without npm it says so and installs nothing (the tests then
# say what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
CODEX_VERSION=0.171.0
CLAUDE_VERSION=2.1.332
if ! command -v npm >/dev/null; then
  echo "setup_clients: npm is missing (Node 20+): the Codex CLI and Claude Code tests cannot run" >&2
  exit 0
fi
install() {  # folder, package@version, the version string its binary prints
  local dir=$1 package=$2
  if [ ! -f "$dir/node_modules/${package%@*}/package.json" ] || \
     ! grep -q "\"version\": \"${package##*@}\"" "$dir/node_modules/${package%@*}/package.json"; then
    npm install --silent --prefix "$dir" "$package" --no-audit --no-fund --no-save >/dev/null
  fi
}
install .clients/codex "@openai/codex@$CODEX_VERSION"
install .clients/claude "@anthropic-ai/claude-code@$CLAUDE_VERSION"
