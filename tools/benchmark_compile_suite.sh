#!/usr/bin/env bash
# The runs behind docs/BENCHMARKS.md, on one CUDA GPU (dp2: two). Usage: tools/benchmark_compile_suite.sh sdxl|sdxl_gc_blocks_only|sdxl_warm|sdxl_final|final|warm_gc|freeze|flux|flux_presets|tune_sdxl|fused|fused_final|sdp|sdp_bs4|attn_lora|lycoris[_bs1|_bs4]|record|full_sdxl|dp2|shipped_buckets|shipped_fixed|shipped_recording|step_graph|step_graph_more|cudnn_flux|cudnn_sdxl|keep_sdxl|keep_flux|keep_buckets [OUTDIR]
# Each configuration runs in its own process (eager and compiled in that one process) with a fresh compile
# cache, so "first compiled step" is a cold compile; the warm-start run reuses the SDXL bs1+GC cache.
set -u
cd "$(dirname "$0")/.."
OUTDIR=${2:-${OUT:-bench_out}}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
CACHE_ROOT=${COMPILE_CACHE_ROOT:-/tmp/compile_cache}  # not CC: that is the C compiler variable triton reads
STEPS=${STEPS:-15}
WARMUP=${WARMUP:-4}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
before_tree() {  # a copy of sd-scripts in $1 with the image-size dynamic marks of --compile_dynamic auto off
  rm -rf "$1" && mkdir -p "$1" && cp -r sd-scripts "$1/"
  sed -i 's/^    if dynamic is None:  # auto: the image-size dims/    if False:  # before: no image-size marks/' \
    "$1/sd-scripts/library/compile/regional.py"
  grep -q "if False:  # before: no image-size marks" "$1/sd-scripts/library/compile/regional.py" || { echo "before tree not made"; exit 1; }
}
WORK=${WORKDIR:-/tmp/bench_shipped}  # the shipped_* cases: tools/bench_shipped.py's work folder
B="$PY tools/bench_shipped.py"
prepare_shipped() {  # bench_shipped.py prepare with more flags ($@); stops the case when it fails
  echo "=== prepare"
  $B prepare --workdir "$WORK" "$@" >"$OUTDIR/prepare.log" 2>&1 || { tail -20 "$OUTDIR/prepare.log"; exit 1; }
}
run() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  timeout "$limit" $PY tools/benchmark_compile.py --steps "$STEPS" --warmup "$WARMUP" --json_out "$OUTDIR/$name.json" "$@" \
    >"$OUTDIR/$name.log" 2>&1
  echo "exit $? ($name)"; grep -v "__recompiles\]" "$OUTDIR/$name.log" | tail -6
}
case "${1:-}" in
  sdxl)
    rm -rf "$CACHE_ROOT"
    run sdxl_bs1 240 --family sdxl --batch_size 1 --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1"
    run sdxl_bs1_gc 240 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc"
    run sdxl_bs1_gc_warm 120 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc" --phases compiled
    run sdxl_bs4_gc 240 --family sdxl --batch_size 4 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs4_gc"
    ;;
  sdxl_gc_blocks_only)  # checkpoint only the compiled blocks (resnets not checkpointed), then a warm restart
    run sdxl_bs1_gcb 150 --family sdxl --batch_size 1 --gradient_checkpointing --gc_blocks_only --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gcb" --phases compiled
    run sdxl_bs1_gcb_warm 90 --family sdxl --batch_size 1 --gradient_checkpointing --gc_blocks_only --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gcb" --phases compiled --steps 5
    ;;
  sdxl_warm)  # warm start where the FX/autograd cache applies (no checkpoint HOP), static shapes, GC cache bypass reason
    run sdxl_bs1_cold 150 --family sdxl --batch_size 1 --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1" --phases compiled
    run sdxl_bs1_warm 90 --family sdxl --batch_size 1 --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1" --phases compiled --steps 5
    run sdxl_bs1_static 150 --family sdxl --batch_size 1 --compile_mode reduce-overhead --compile_dynamic false --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_static" --phases compiled
    run sdxl_bs1_gc_short 120 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc" --phases compiled --steps 3
    ;;
  sdxl_final)  # after the RNG-state fix: GC cold + warm, bs4 GC, and a GC-pause check
    run sdxl_bs1_gc 200 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc" --steps 20
    run sdxl_bs1_gc_warm 80 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc" --phases compiled --steps 20
    run sdxl_bs4_gc 150 --family sdxl --batch_size 4 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs4_gc" --phases compiled --steps 20
    run sdxl_bs1_gcfreeze 130 --family sdxl --batch_size 1 --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1" --phases compiled --steps 30 --gc_freeze
    ;;
  final)  # checkpointing with attention saved (selective checkpoint): SDXL GC cold + warm, bs4 GC, FLUX 1024 GC
    run sdxl_bs1_gc 200 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc" --steps 20
    run sdxl_bs1_gc_warm 80 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc" --phases compiled --steps 20
    run sdxl_bs4_gc 200 --family sdxl --batch_size 4 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs4_gc" --steps 15
    run flux_1024_gc 200 --family flux --resolution 1024 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/flux_1024_gc" --phases compiled
    ;;
  warm_gc)  # cold then warm start of SDXL bs1 with checkpointing (FX + AOTAutograd caches)
    run sdxl_bs1_gc_cold 150 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc" --phases compiled --steps 10
    run sdxl_bs1_gc_warm 90 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc" --phases compiled --steps 10
    ;;
  freeze)  # SDXL bs1 / FLUX 512 compiled phase again (measured with a gc.freeze() experiment that was reverted)
    run sdxl_bs1_freeze 150 --family sdxl --batch_size 1 --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1" --phases compiled --steps 20
    run flux_512_freeze 200 --family flux --resolution 512 --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/flux_512" --phases compiled --steps 20
    ;;
  flux)
    run flux_512 200 --family flux --resolution 512 --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/flux_512"
    run flux_1024_gc 220 --family flux --resolution 1024 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/flux_1024_gc"
    ;;
  flux_presets)  # FLUX.1 LoRA presets' memory at 1024 px (rank 16): fp8 base (24 GB), + swap 24 (16 GB), 44 (12 GB); parallel
    # (peak memory is per process; step ms is then shared-GPU time). Each starts once the last has its model
    # built (the bf16 build before fp8 takes 24 GB for a moment). nvidia-smi samples add each CUDA context.
    P="--family flux --resolution 1024 --rank 16 --gradient_checkpointing --fp8_base --phases compiled"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 500 >/tmp/smi.csv 2>/dev/null &
    SMI=$!
    built() { until grep -q "model ready" "$OUTDIR/$1.log" 2>/dev/null || ! kill -0 "$2" 2>/dev/null; do sleep 1; done; }
    run flux_1024_fp8_ro 300 $P --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/a" & W=$!
    built flux_1024_fp8_ro $!
    run flux_1024_fp8_swap24 300 $P --blocks_to_swap 24 --compile_mode default --compile_cache_dir "$CACHE_ROOT/b" & W="$W $!"
    built flux_1024_fp8_swap24 $!
    run flux_1024_fp8_swap44 300 $P --blocks_to_swap 44 --compile_mode default --compile_cache_dir "$CACHE_ROOT/c" & W="$W $!"
    wait $W
    kill "$SMI" 2>/dev/null
    echo "nvidia-smi peak MiB per process:"; sort -t, -k1,1 -k2,2n /tmp/smi.csv | awk -F, '{m[$1]=$2} END {for (p in m) print p, m[p]}'
    ;;
  tune_sdxl)  # SDXL bs1 compiled with cuDNN SDPA / cudnn.benchmark / channels-last, one shared cache; then GC and bs4
    C="--family sdxl --compile_mode reduce-overhead --phases compiled --compile_cache_dir $CACHE_ROOT/tune"
    run sdxl_bs1_control 150 $C --profile 3
    run sdxl_bs1_all 150 $C --cudnn_sdp on --cuda_cudnn_benchmark --channels_last --profile 3
    run sdxl_bs1_gc_all 150 $C --gradient_checkpointing --cudnn_sdp on --cuda_cudnn_benchmark --channels_last
    run sdxl_bs4_gc_all 150 $C --batch_size 4 --gradient_checkpointing --cudnn_sdp on --cuda_cudnn_benchmark --channels_last
    run sdxl_bs1_sdp 120 $C --cudnn_sdp on
    run sdxl_bs1_chl 120 $C --channels_last --cuda_cudnn_benchmark
    ;;
  fused)  # fused AdamW (the trainers' default now) vs foreach; checkpointing of the compiled blocks only (gcb)
    C="--family sdxl --compile_mode reduce-overhead --phases compiled --compile_cache_dir $CACHE_ROOT/fused"
    run sdxl_bs1_fused 110 $C --profile 3
    run sdxl_bs1_foreach 110 $C --adamw foreach --profile 3
    run sdxl_bs1_gc_fused 110 $C --gradient_checkpointing
    run sdxl_bs4_gc_fused 110 $C --batch_size 4 --gradient_checkpointing --profile 2
    run sdxl_bs4_gcb_fused 110 $C --batch_size 4 --gradient_checkpointing --gc_blocks_only
    run sdxl_bs1_gcb_fused 110 $C --gradient_checkpointing --gc_blocks_only
    ;;
  fused_final)  # with fused AdamW: FLUX 512 and SDXL bs1 / bs1+GC / bs4+GC, eager and compiled, fresh caches
    rm -rf "$CACHE_ROOT"
    run flux_512 190 --family flux --resolution 512 --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/flux_512"
    run sdxl_bs1 120 --family sdxl --batch_size 1 --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1"
    run sdxl_bs1_gc 120 --family sdxl --batch_size 1 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs1_gc"
    run sdxl_bs4_gc 130 --family sdxl --batch_size 4 --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/sdxl_bs4_gc"
    ;;
  sdp)  # session 3: cuDNN SDPA for SDXL on its own (bs4+GC is GPU-bound), cudnn.benchmark, cudagraph slow-path asserts off
    C="--family sdxl --compile_mode reduce-overhead --phases compiled --gradient_checkpointing"
    rm -rf "$CACHE_ROOT"
    run sdxl_bs4_gc 120 $C --batch_size 4 --compile_cache_dir "$CACHE_ROOT/flash"
    run sdxl_bs4_gc_sdp 120 $C --batch_size 4 --cudnn_sdp on --compile_cache_dir "$CACHE_ROOT/cudnn" --profile 2
    run sdxl_bs4_gc_sdp_bench 100 $C --batch_size 4 --cudnn_sdp on --cuda_cudnn_benchmark --compile_cache_dir "$CACHE_ROOT/cudnn"
    run sdxl_bs1_gc_sdp 100 $C --cudnn_sdp on --compile_cache_dir "$CACHE_ROOT/cudnn" --profile 3
    run sdxl_bs1_gc_noassert 100 $C --compile_cache_dir "$CACHE_ROOT/flash" --inductor_config triton.slow_path_cudagraph_asserts=False
    ;;
  sdp_bs4)  # session 3: bs4+GC with flash attention vs cuDNN SDPA on one machine (run22)
    C="--family sdxl --compile_mode reduce-overhead --phases compiled --gradient_checkpointing --batch_size 4 --profile 2"
    rm -rf "$CACHE_ROOT"
    run sdxl_bs4_gc_flash 150 $C --compile_cache_dir "$CACHE_ROOT/flash"
    run sdxl_bs4_gc_cudnn 150 $C --cudnn_sdp on --compile_cache_dir "$CACHE_ROOT/cudnn"
    ;;
  attn_lora)  # session 3: the checkpointed SDXL targets with LoRA on the attention projections only (run23)
    C="--family sdxl --compile_mode reduce-overhead --phases compiled --gradient_checkpointing --attention_only_lora"
    rm -rf "$CACHE_ROOT"
    run sdxl_bs4_gc_attn 150 $C --batch_size 4 --compile_cache_dir "$CACHE_ROOT/attn"
    run sdxl_bs1_gc_attn 150 $C --compile_cache_dir "$CACHE_ROOT/attn"
    ;;
  lycoris|lycoris_bs1|lycoris_bs4)  # issue 12: kohya LoRA r32 vs LyCORIS LoCon and LoKr (dim 32, full preset),
    # bs1 and bs4 + GC, compiled (lycoris_bs1 / lycoris_bs4: one batch size, to fit a 10-minute device call)
    C="--family sdxl --compile_mode reduce-overhead --phases compiled --rank 32"
    rm -rf "$CACHE_ROOT"
    case "$1" in lycoris_bs1) BATCHES=("1") ;; lycoris_bs4) BATCHES=("4 --gradient_checkpointing") ;;
      *) BATCHES=("1" "4 --gradient_checkpointing") ;; esac
    for B in "${BATCHES[@]}"; do
      N=bs${B%% *}
      run sdxl_${N}_lora ${RUN_LIMIT:-200} $C --batch_size $B --compile_cache_dir "$CACHE_ROOT/lora_$N"
      run sdxl_${N}_locon ${RUN_LIMIT:-200} $C --batch_size $B --network_module lycoris.kohya --network_args algo=locon --compile_cache_dir "$CACHE_ROOT/locon_$N"
      run sdxl_${N}_lokr ${RUN_LIMIT:-200} $C --batch_size $B --network_module lycoris.kohya --network_args algo=lokr factor=8 --compile_cache_dir "$CACHE_ROOT/lokr_$N"
    done
    ;;
  record)  # session 3: what the 2nd compiled step (CUDA graph recording) spends its time on
    C="--family sdxl --compile_mode reduce-overhead --phases compiled --compile_cache_dir $CACHE_ROOT/record"
    rm -rf "$CACHE_ROOT"
    run sdxl_bs1_noassert 240 $C --inductor_config triton.slow_path_cudagraph_asserts=False
    run sdxl_bs1_keep 150 $C --keep_cache_on_capture
    ;;
  full_sdxl)  # issue 6: SDXL full fine-tune (sdxl_train.py's 24 GB setup), 1024 px bs1, eager and compiled
    run sdxl_full_gc 300 --family sdxl --full --gradient_checkpointing --compile_mode reduce-overhead --compile_cache_dir "$CACHE_ROOT/full" --steps 8 --warmup 3
    ;;
  dp2)  # issue 6: SDXL LoRA data-parallel on 2 GPUs vs 1, compile on in both (the 1-GPU run warms the cache)
    D="--family sdxl --batch_size ${BS:-1} --compile_mode reduce-overhead --phases compiled --compile_cache_dir $CACHE_ROOT/dp ${DP_ARGS:-}"
    run sdxl_dp1 200 $D
    echo "=== sdxl_dp2: torchrun --nproc_per_node 2 $D"
    timeout 200 $PY -m torch.distributed.run --nproc_per_node 2 tools/benchmark_compile.py --steps "$STEPS" \
      --warmup "$WARMUP" --json_out "$OUTDIR/sdxl_dp2.json" $D >"$OUTDIR/sdxl_dp2.log" 2>&1
    echo "exit $? (sdxl_dp2)"; grep -v "__recompiles\]" "$OUTDIR/sdxl_dp2.log" | tail -6
    $PY -c "import json,sys; a,b=(json.load(open(f'$OUTDIR/sdxl_dp{n}.json'))['compiled']['images_per_s'] for n in (1,2)); print(f'images/s 1 GPU {a:.2f}, 2 GPUs {b:.2f}: {b/a:.2f}x')"
    ;;
  shipped_fixed)  # issue 15: one fixed 1024x1024 shape, SDXL LoRA r32 bs1 (no GC), reduce-overhead, shipped
    # trainer: "before" = this tree with the image-size dynamic marks off, "after" = this tree (auto marks them)
    BEFORE=/tmp/before_tree
    before_tree "$BEFORE"
    prepare_shipped
    for tag in before after; do
      dir=$([ $tag = before ] && echo "$BEFORE/sd-scripts" || echo sd-scripts)
      echo "=== fixed $tag"
      $B run --workdir "$WORK" --phases compiled --steps ${STEPS_FIXED:-60} --tag fixed_$tag --scripts_dir "$dir" \
        --timeout ${LIMIT_FIXED:-220} --json_out "$OUTDIR/fixed_$tag.json" | cut -c1-1500
    done
    ;;
  shipped_buckets)  # issue 15: the SHIPPED SDXL LoRA trainer (tools/bench_shipped.py), r32 bs1 + GC, reduce-overhead,
    # on 4 bucket shapes: "before" = this tree with the image-size dynamic marks off (a copy of sd-scripts),
    # "after" = this tree; then a warm restart on one shape (1024x1024) from the "after" compile cache.
    BEFORE=/tmp/before_tree
    before_tree "$BEFORE"
    prepare_shipped --buckets
    tail -2 "$OUTDIR/prepare.log"
    R="run --workdir $WORK --phases compiled --gradient_checkpointing --recompiles --time_graphs"
    for tag in before after; do
      dir=$([ $tag = before ] && echo "$BEFORE/sd-scripts" || echo sd-scripts)
      echo "=== buckets $tag"
      $B $R --buckets --steps ${STEPS_BUCKETS:-24} --tag $tag --scripts_dir "$dir" --timeout ${LIMIT_BUCKETS:-200} \
        --log_out "$OUTDIR/buckets_$tag.log" --json_out "$OUTDIR/buckets_$tag.json" | cut -c1-1500
    done
    echo "=== warm restart, one shape, on the 'after' cache"
    $B $R --steps 10 --tag warm --cache_tag after --timeout ${LIMIT_WARM:-100} --log_out "$OUTDIR/warm.log" \
      --json_out "$OUTDIR/warm.json" | cut -c1-1500
    ;;
  step_graph)  # issue 15 item 6: --cuda_graph_step. The same 12 steps with and without it (blocks compiled with
    # mode default in both: the same kernels; cosine schedule with warm-up, so the rate changes every step), the saved
    # LoRA files compared; whether the step with min-SNR and noise offset captures; then SDXL bs1 and bs1 + GC, 45
    # steps: reduce-overhead (the blocks' own CUDA graphs) against reduce-overhead + --cuda_graph_step
    prepare_shipped
    R="run --workdir $WORK --phases compiled --log_out $OUTDIR/trainer.log"
    CHECK="--lr_scheduler cosine --lr_warmup_steps 4"
    echo "=== check: ordinary"; $B $R --compile_mode default --steps 12 --tag ref --json_out $OUTDIR/check_ref.json -- $CHECK | cut -c1-400
    echo "=== check: step graph"; $B $R --compile_mode default --steps 12 --tag sg --cache_tag ref --json_out $OUTDIR/check_sg.json -- $CHECK --cuda_graph_step | cut -c1-400
    $PY - "$WORK/out_ref_compiled/bench.safetensors" "$WORK/out_sg_compiled/bench.safetensors" <<'PYEOF'
import sys
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert a.keys() == b.keys(), "different keys"
ups = [k for k in a if "lora_up" in k]  # they start at zero: what the 12 steps trained
norm = lambda ts: sum(float((t.float() ** 2).sum()) for t in ts) ** 0.5
trained = norm(a[k] for k in ups)
print(f"check: {len(a)} tensors; lora_up trained to norm {trained:.4g}, the two runs differ by norm "
      f"{norm(a[k] - b[k] for k in ups):.4g} (ordinary, same kernels: nondeterministic bf16 grads differ too)")
PYEOF
    echo "=== capture with min-SNR and noise offset"; $B $R --compile_mode default --steps 6 --tag sg_opts --cache_tag ref -- --cuda_graph_step --min_snr_gamma 5 --noise_offset 0.05 | cut -c1-300
    grep -h "step graph:" "$OUTDIR/trainer.log" | cut -c1-300
    for gc in "" --gradient_checkpointing; do
      t=${gc:+_gc}
      echo "=== blocks$t"; $B $R $gc --steps 45 --tag ro$t --json_out $OUTDIR/ro$t.json | cut -c1-400
      echo "=== step graph$t"; $B $R $gc --steps 45 --tag sg$t --cache_tag ref$t --json_out $OUTDIR/sg$t.json -- --cuda_graph_step | cut -c1-400
    done
    ;;
  step_graph_more)  # --cuda_graph_step with 4 bucket shapes (SDXL bs1 + GC, a graph per shape) and FLUX.1 (1024 bs1 +
    # GC): reduce-overhead (the blocks' own CUDA graphs) against reduce-overhead + --cuda_graph_step
    prepare_shipped --buckets
    R="run --workdir $WORK --phases compiled --gradient_checkpointing --recompiles --log_out $OUTDIR/trainer.log"
    for sg in "" --cuda_graph_step; do
      echo "=== buckets ${sg:-blocks}"; $B $R --buckets --steps 30 --tag bk${sg:+_sg} --json_out $OUTDIR/buckets${sg:+_sg}.json \
        --timeout 200 ${sg:+-- $sg} | cut -c1-700
    done
    grep -h "step graph:" "$OUTDIR/trainer.log" | cut -c1-200
    prepare_shipped --family flux
    for sg in "" --cuda_graph_step; do
      echo "=== flux ${sg:-blocks}"; $B $R --family flux --steps 20 --tag flux${sg:+_sg} --json_out $OUTDIR/flux${sg:+_sg}.json \
        --timeout 200 ${sg:+-- $sg} | cut -c1-500
    done
    ;;
  cudnn_flux)  # issue 15: --cudnn_sdp on FLUX.1 (shipped flux_train_network.py): the attention probe, then 1024 bs1 + GC
    # reduce-overhead with flash attention (--cudnn_sdp off) against cuDNN (on), then cuDNN eager at 512 px (where
    # its backward once crashed); one call, ~8 min on a fresh H100
    echo "=== probe"; timeout 120 $PY tools/probe_cudnn_sdpa.py
    prepare_shipped --family flux
    R="run --workdir $WORK --family flux --log_out $OUTDIR/trainer.log"
    for v in off on; do
      echo "=== 1024 + GC, --cudnn_sdp $v"; $B $R --phases compiled --gradient_checkpointing --steps 25 --tag cudnn_$v \
        --json_out $OUTDIR/flux_cudnn_$v.json --timeout 200 -- --cudnn_sdp $v | cut -c1-600
    done
    echo "=== 512 eager, --cudnn_sdp on"; $B $R --phases eager --resolution 512 --steps 8 --warmup 3 --tag e512 \
      --json_out $OUTDIR/flux_e512.json --timeout 150 -- --cudnn_sdp on | cut -c1-600
    grep -h -i "illegal memory\|cuDNN SDPA" "$OUTDIR/trainer.log" | cut -c1-200 | sort | uniq -c
    ;;
  cudnn_sdxl)  # issue 15: SDXL 1024 bs4 + GC and bs1 + GC (the summary's peak memory), shipped sdxl_train_network.py:
    # the blocks' own CUDA graphs or --cuda_graph_step, each with flash attention and with --cudnn_sdp on (~1 min a
    # run: BS_LIST=4, then BS_LIST=1 in a second call keeps each call under 10 min)
    prepare_shipped
    R="run --workdir $WORK --phases compiled --gradient_checkpointing --steps 30 --log_out $OUTDIR/trainer.log"
    for bs in ${BS_LIST:-4 1}; do
      for v in "" "--cuda_graph_step" "--cudnn_sdp on" "--cuda_graph_step --cudnn_sdp on"; do
        t=bs${bs}$(echo "$v" | tr -d ' -' | sed 's/cuda_graph_step/_sg/; s/cudnn_sdpon/_cudnn/g')
        echo "=== bs$bs ${v:-blocks}"; $B $R --batch_size $bs --tag $t --json_out $OUTDIR/$t.json --timeout 150 \
          ${v:+-- $v} | cut -c1-500
      done
    done
    ;;
  keep_sdxl)  # issue 15: SDXL 1024 bs$BS (default 4) + GC (step graph, cuDNN attention) with each --compile_checkpoint_keep
    # of KEEP_LIST, then (CUDNN_BENCH=1, the default) attention with cudnn.benchmark for the eager ResNet convolutions
    # (its search runs before the capture); ~70 s a run
    prepare_shipped
    R="run --workdir $WORK --phases compiled --gradient_checkpointing --batch_size ${BS:-4} --steps 30 --log_out $OUTDIR/trainer.log"
    for v in ${KEEP_LIST:-attention projections} $([ "${CUDNN_BENCH:-1}" = 1 ] && echo attention_bench); do
      t=bs${BS:-4}_keep_$v
      echo "=== $t"; $B $R --tag $t --json_out $OUTDIR/$t.json --timeout 150 \
        -- --cuda_graph_step --cudnn_sdp on --compile_checkpoint_keep ${v%_bench} \
        $([ "$v" = attention_bench ] && echo --cuda_cudnn_benchmark) | cut -c1-500
    done
    ;;
  keep_buckets)  # issue 15: SDXL bs1 + GC on 4 bucket shapes (blocks' CUDA graphs) with --compile_checkpoint_keep
    # projections: recompiles and the summary line
    prepare_shipped --buckets
    $B run --workdir $WORK --phases compiled --gradient_checkpointing --recompiles --buckets --steps 24 \
      --tag buckets_projections --timeout 200 --log_out "$OUTDIR/buckets.log" --json_out "$OUTDIR/buckets_projections.json" \
      -- --compile_checkpoint_keep projections | cut -c1-1200
    ;;
  keep_flux)  # issue 15: FLUX.1 1024 + GC with --compile_checkpoint_keep attention and projections (KEEP_LIST), with
    # --cudnn_sdp $CUDNN (default on); ~2 min a run
    prepare_shipped --family flux
    R="run --workdir $WORK --family flux --phases compiled --gradient_checkpointing --steps 25 --log_out $OUTDIR/trainer.log"
    for v in ${KEEP_LIST:-attention projections}; do
      t=flux_keep_${v}_cudnn_${CUDNN:-on}
      echo "=== $t"; $B $R --tag $t --json_out $OUTDIR/$t.json --timeout 220 \
        -- --cudnn_sdp ${CUDNN:-on} --compile_checkpoint_keep $v | cut -c1-600
    done
    ;;
  shipped_recording)  # issue 15: warm restarts of the shipped SDXL LoRA trainer (r32 bs1 + GC, one 1024 shape) with
    # torch's CUDA-graph bookkeeping, without its pool checks, and as shipped (library/cuda_graph_recording.py), on one
    # cache made by a cold run first; then one shipped run under cProfile (tools/graph_timing.py GRAPH_TIMING_*)
    prepare_shipped
    R="run --workdir $WORK --phases compiled --gradient_checkpointing --time_graphs --log_out $OUTDIR/trainer.log"
    echo "=== cold"; $B $R --steps 6 --tag cold --timeout ${LIMIT_COLD:-220} | cut -c1-1500
    for v in torch no_pool_checks shipped; do
      echo "=== warm $v"
      GRAPH_TIMING_VARIANT=$v $B $R --steps 5 --tag warm_$v --cache_tag cold --timeout ${LIMIT_WARM:-100} | cut -c1-1500
    done
    echo "=== warm, profiled"
    GRAPH_TIMING_PROFILE=1 $B $R --steps 4 --tag warm_prof --cache_tag cold --timeout ${LIMIT_WARM:-100} | cut -c1-1500
    ;;
  *) echo "usage: $0 sdxl|flux|tune_sdxl|full_sdxl|dp2|... [OUTDIR]"; exit 2 ;;
esac
