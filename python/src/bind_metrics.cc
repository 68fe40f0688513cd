// spillway._spillway's binding of spillway::metrics: the Prometheus exporter (spillway.metrics),
// what it watches, and starting it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "errors.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/metrics/exporter.h"
#include "spillway/torch_alloc/shared_arena.h"

namespace py = pybind11;

namespace spillway::python {

void BindMetrics(py::module_& m) {
  py::class_<metrics::Exporter>(m, "Exporter")
      .def_property_readonly("port", &metrics::Exporter::port)
      .def_property_readonly("address", &metrics::Exporter::address)
      .def("render", &metrics::Exporter::Render)
      .def(
          "watch",
          [](metrics::Exporter& e, std::shared_ptr<torch_alloc::SharedArena> a) {
            e.Watch(a->get());
            e.Watch(&a->ledger());
          },
          py::keep_alive<1, 2>())
      .def("_watch_node", [](metrics::Exporter& e) {
        // The exporter holds a raw pointer: every governor it watches is kept for the life of
        // the process (one per join, at most a few).
        static auto* kept = new std::vector<std::shared_ptr<allocator::NodeGovernor>>();
        std::shared_ptr<allocator::NodeGovernor> g = allocator::NodeGovernor::Current();
        if (g == nullptr) return false;
        kept->push_back(g);
        e.Watch(g.get());
        return true;
      });
  m.def(
      "_serve",
      [](const std::string& address, const std::map<std::string, std::string>& labels) {
        metrics::ExporterOptions o;
        o.address = address;
        o.const_labels.assign(labels.begin(), labels.end());
        return std::unique_ptr<metrics::Exporter>(Check(metrics::Exporter::Start(o)).release());
      },
      py::arg("address"), py::arg("labels") = std::map<std::string, std::string>{});
}

}  // namespace spillway::python
