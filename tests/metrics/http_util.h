// Loopback HTTP for the metrics tests: a raw GET (or any raw bytes) to 127.0.0.1, and a real
// Prometheus server started and removed by the test.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace spillway::metrics::testing {

// Sends `raw` to 127.0.0.1:port and returns everything the server answers (empty on failure).
inline std::string RawRequest(int port, const std::string& raw) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      send(fd, raw.data(), raw.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(raw.size())) {
    char buf[16384];
    ssize_t n;
    while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

inline std::string HttpGet(int port, const std::string& path) {
  return RawRequest(port,
                    "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
}

inline std::string Body(const std::string& response) {
  auto p = response.find("\r\n\r\n");
  return p == std::string::npos ? "" : response.substr(p + 4);
}

// A port that was free a moment ago (the kernel picks it).
inline int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// /usr/bin/prometheus scraping one target every second, with its own data directory.
class PrometheusServer {
 public:
  static constexpr const char* kBinary = "/usr/bin/prometheus";
  static bool Available() { return access(kBinary, X_OK) == 0; }

  explicit PrometheusServer(int target_port) {
    dir_ = std::filesystem::temp_directory_path() /
           ("spillway-prom-" + std::to_string(getpid()) + "-" + std::to_string(target_port));
    std::filesystem::create_directories(dir_ / "data");
    std::ofstream(dir_ / "prometheus.yml")
        << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        << "scrape_configs:\n  - job_name: spillway\n    static_configs:\n"
        << "      - targets: ['127.0.0.1:" << target_port << "']\n";
    port_ = FreePort();
    pid_ = fork();
    if (pid_ == 0) {
      const std::string cfg = "--config.file=" + (dir_ / "prometheus.yml").string();
      const std::string data = "--storage.tsdb.path=" + (dir_ / "data").string();
      const std::string listen = "--web.listen-address=127.0.0.1:" + std::to_string(port_);
      std::freopen((dir_ / "prometheus.log").c_str(), "w", stderr);
      execl(kBinary, kBinary, cfg.c_str(), data.c_str(), listen.c_str(), "--log.level=warn",
            static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~PrometheusServer() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status;
      waitpid(pid_, &status, 0);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  int port() const { return port_; }
  std::string Log() const {
    std::ifstream in(dir_ / "prometheus.log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // Waits until the server answers its readiness endpoint.
  bool WaitReady(std::chrono::seconds timeout) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      if (HttpGet(port_, "/-/ready").find(" 200 ") != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return false;
  }

 private:
  std::filesystem::path dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace spillway::metrics::testing
