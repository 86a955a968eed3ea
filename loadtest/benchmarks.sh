#!/usr/bin/env bash
# Every benchmark behind docs/benchmarks.md, one after another. Each step writes the result file that
# `python -m loadtest.publish` renders into docs/results/ (commit them with the document: every published
# number can then be re-rendered and checked); logs and full per-request results go to loadtest/results/bench/.
# About 3 hours on the 2-core development machine; run it on a quiet one.
#
#   loadtest/peers/install-all.sh     # once: the peer routers (vllm-router, sglang-router, LiteLLM, nginx)
#   loadtest/benchmarks.sh            # everything; or name steps: loadtest/benchmarks.sh seed-table lab
#   python -m loadtest.publish        # then: the tables and plots of docs/benchmarks.md
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=loadtest/results/bench
KEEP=docs/results
mkdir -p "$OUT" "$KEEP/lab" "$KEEP/scenarios"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(seed-table seed-table-weighted degraded-node prefix-heavy no-sharing
                                 peers-heterogeneous peers-prefix-heavy peers-prefix-heavy-repeat peers-prefix-heavy-high
                                 overhead scale lab streams faults tenants batching-modes soak kv-ingest)
for step in "${steps[@]}"; do
    echo "=== $step ($(date -u +%H:%M:%S))"
    case "$step" in
        overhead)
            python -m loadtest.router_overhead --out "$OUT/overhead" --envoy-epp \
                --peers vllm-router:round_robin,sglang-router:round_robin,litellm:simple-shuffle,nginx:least_conn \
                && cp "$(ls "$OUT"/overhead/router-overhead-*.json | tail -1)" "$KEEP/overhead.json" ;;
        scale)
            mkdir -p "$OUT/scale"
            python -m loadtest.scale --json "$KEEP/scale.json" --markdown "$OUT/scale/scale.md" \
                --plots "$OUT/scale" ;;
        batching-modes)
            python -m loadtest.batching_modes --json "$KEEP/batching-modes.json" ;;
        soak)
            python -m loadtest.soak --duration 180 --json "$KEEP/soak.json" ;;
        streams)
            python -m loadtest.streams --no-pin --open-rate 250 --json "$KEEP/streams.json" ;;
        faults)
            python -m loadtest.faults --json "$KEEP/faults.json" ;;
        tenants)
            python -m loadtest.tenants --json "$KEEP/tenants.json" ;;
        lab)
            mkdir -p "$OUT/lab"
            LEAST_PREFILL='prefix-aware least-prefill={"strategy": "prefix-aware", "prefixAware": {"selection": "least-prefill"}}'
            for f in 0.3 0.6 0.9; do
                python -m loadtest.lab loadtest/scenarios/seed-table.yaml --fraction $f --seeds 5 \
                    --policy 'adaptive, best-score (before)={"strategy": "adaptive", "adaptive": {"selection": "best-score"}}' \
                    --policy 'adaptive, choices all={"strategy": "adaptive", "adaptive": {"choices": "all"}}' \
                    --policy "$LEAST_PREFILL" --json "$KEEP/lab/seed-table-$f.json"
            done
            python -m loadtest.lab loadtest/scenarios/seed-table-weighted.yaml --fraction 0.6 --seeds 5 \
                --policy "$LEAST_PREFILL" --json "$KEEP/lab/seed-table-weighted-0.6.json"
            for f in 0.5 0.8; do
                python -m loadtest.lab loadtest/scenarios/prefix-heavy.yaml --fraction $f --seeds 6 \
                    --policy 'least-prefill, maxImbalance 8={"strategy": "prefix-aware", "prefixAware": {"selection": "least-prefill", "maxImbalance": 8}}' \
                    --json "$KEEP/lab/prefix-heavy-$f.json"
            done
            for f in 0.6 0.9; do
                python -m loadtest.lab loadtest/scenarios/no-sharing.yaml --fraction $f --seeds 8 \
                    --policy 'prefix-aware, any match (minMatchShare 0)={"strategy": "prefix-aware", "prefixAware": {"minMatchShare": 0}}' \
                    --json "$KEEP/lab/no-sharing-$f.json"
            done
            # Precise (KV events) against approximate prefix indexes, same requests.
            KV=(--only --policy round-robin --policy least-connections
                --policy 'prefix-aware (approximate)={"strategy": "prefix-aware", "prefixAware": {}}'
                --policy 'prefix-aware precise={"strategy": "prefix-aware", "prefixAware": {"index": "precise"}}'
                --policy 'least-prefill (approximate)={"strategy": "prefix-aware", "prefixAware": {"selection": "least-prefill"}}'
                --policy 'least-prefill precise={"strategy": "prefix-aware", "prefixAware": {"selection": "least-prefill", "index": "precise"}}')
            python -m loadtest.lab loadtest/scenarios/prefix-heavy.yaml --fraction 0.8 --seeds 5 "${KV[@]}" \
                --json "$KEEP/lab/kv-prefix-heavy-0.8.json"
            python -m loadtest.lab loadtest/scenarios/mooncake-conversation.yaml --fraction 0.6 --seeds 5 "${KV[@]}" \
                --json "$KEEP/lab/kv-mooncake-conversation-0.6.json"
            python -m loadtest.lab loadtest/scenarios/lab-1000.yaml --fraction 0.6 --seeds 3 \
                --json "$KEEP/lab/lab-1000-0.6.json" ;;
        kv-ingest)
            python -m loadtest.kv_ingest --json "$KEEP/kv-ingest.json" ;;
        *)
            fleetroute loadtest --scenario "loadtest/scenarios/$step.yaml" --out "$OUT/$step" > "$OUT/$step.log" 2>&1
            rc=$?
            echo "exit $rc ($step)"
            [ $rc -eq 0 ] && cp "$OUT/$step/summary.json" "$KEEP/scenarios/$step.json" ;;
    esac
done
echo "=== done ($(date -u +%H:%M:%S))"
