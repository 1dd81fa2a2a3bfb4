// run_graph on the CUDA backend: a decode step is ~25 small ops per layer, ~700 launches for DeepSeek-V2-Lite, and at
// small batches their launch overhead, not the memory traffic, set the step time (4.7 ms against a 1.18 ms roofline
// on the H200 at batch 1). A CUDA graph per GraphKey replays them with one launch, as vLLM and SGLang do.
// Per key: the first run is eager (scratch buffers reach their sizes, cuBLASLt plans and lazily loaded kernels
// exist), the second is captured and launched, later ones only launch. What makes a replay right is in
// cuda_backend.h's header comment.
#include <string>
#include <utility>

#include "check.h"
#include "cuda_backend.h"

namespace deepinfer::backend::cuda {

Status CudaBackend::run_graph(const GraphKey& key, const std::function<void()>& ops) {
  BACKEND_CHECK(!capturing_, "run_graph inside run_graph's ops");
  BACKEND_CHECK(key.rows == step_.rows && key.sequences == step_.sequences &&
                    key.max_blocks_per_sequence == step_.max_blocks &&
                    key.logits_rows == static_cast<int64_t>(step_.logits_rows.size()),
                "run_graph: key [rows " + std::to_string(key.rows) + ", sequences " + std::to_string(key.sequences) +
                    ", blocks " + std::to_string(key.max_blocks_per_sequence) + ", logits rows " +
                    std::to_string(key.logits_rows) + "] is not the step's [" + std::to_string(step_.rows) + ", " +
                    std::to_string(step_.sequences) + ", " + std::to_string(step_.max_blocks) + ", " +
                    std::to_string(step_.logits_rows.size()) + "]");
  activate();
  if (failed()) return take_sticky();
  // Only steps whose launches follow from the key's shapes: decode and verify steps (rows past a cached context;
  // which row belongs to which sequence, and each row's context, are device data the kernels read). Steps whose
  // rows start at position 0 have host-side values the key does not name (the expanded form's sequence groups).
  if (step_.rows_start_at_zero || step_.rows == 0) {
    ops();
    return take_sticky();
  }

  auto it = graphs_.find(key);
  if (it != graphs_.end() && it->second.generation != buffers_generation_) {
    destroy_graph(it->second);  // a scratch buffer it baked in has moved
    graphs_.erase(it);
    it = graphs_.end();
  }
  if (it == graphs_.end()) {
    // Warm-up: eager, and the sizes every later run of this key reserves.
    ++graph_recordings_;
    host_synchronized_ = false;
    ops();
    if (failed()) return take_sticky();
    Graph graph;
    graph.generation = buffers_generation_;
    graph.capturable = !host_synchronized_;
    graphs_.emplace(key, graph);
    return Status();
  }
  Graph& graph = it->second;
  if (!graph.capturable) {
    ops();
    return take_sticky();
  }
  if (graph.exec == nullptr) {
    ++graph_recordings_;
    if (Status s = capture(graph, ops); !s.ok()) {
      graphs_.erase(it);  // warm up again next time
      return s;
    }
  }
  // The head results the captured compute_logits pointed at: the same scratch memory, rewritten by this launch.
  head_ = graph.head;
  check_cuda(cudaGraphLaunch(graph.exec, stream_), "run_graph (cudaGraphLaunch)");
  if (failed()) return take_sticky();
  ++graph_replays_;
  return Status();
}

Status CudaBackend::capture(Graph& graph, const std::function<void()>& ops) {
  // Thread-local mode: another thread's unrelated CUDA calls (an engine's other backend, say) do not break it,
  // while this thread's forbidden calls (a synchronization) fail loudly instead of corrupting the recording.
  check_cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "run_graph (cudaStreamBeginCapture)");
  if (failed()) return take_sticky();
  capturing_ = true;
  ops();
  join_side_lane();  // the capture must end with every forked stream joined
  capturing_ = false;
  // End the capture whatever happened inside: the stream must leave capture mode before anything else runs on it.
  cudaGraph_t recorded = nullptr;
  check_cuda(cudaStreamEndCapture(stream_, &recorded), "run_graph (cudaStreamEndCapture)");
  if (!failed()) check_cuda(cudaGraphInstantiate(&graph.exec, recorded, 0), "run_graph (cudaGraphInstantiate)");
  if (recorded != nullptr) cudaGraphDestroy(recorded);
  if (failed()) {
    destroy_graph(graph);
    return take_sticky();
  }
  graph.head = head_;
  return Status();
}

void CudaBackend::destroy_graph(Graph& graph) {
  // A launched graph still running is freed when it completes (cudaGraphExecDestroy's contract).
  if (graph.exec != nullptr) cudaGraphExecDestroy(graph.exec);
  graph.exec = nullptr;
}

void CudaBackend::reset_graphs() {
  BACKEND_CHECK(!capturing_, "reset_graphs inside run_graph's ops");
  activate();
  for (auto& [key, graph] : graphs_) destroy_graph(graph);
  graphs_.clear();
}

}  // namespace deepinfer::backend::cuda
